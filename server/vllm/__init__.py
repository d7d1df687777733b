"""vLLM as agentshare's second engine: its instances share one base prefill through agentshare's
KV connector (:mod:`server.vllm.connector`) and a prefix KV store in shared memory
(:mod:`server.vllm.store`). The modules that import vLLM are imported only where it is installed
(the ``vllm`` extra); ``store`` needs numpy only.
"""
