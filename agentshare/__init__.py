"""agentshare: multi-agent LLM apps whose agents share one prefill of their common context."""

__version__ = "0.1.0.dev0"
