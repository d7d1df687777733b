"""vLLM as agentshare's second engine: its instances share one base prefill through agentshare's
KV connector and a prefix KV store in shared memory (docs/vllm.md)::

    connector.py  AgentshareConnector: vLLM's KV connector; saves the base's prefix, loads it for modules
    store.py      KVStore: prefix KV blocks as files in shared memory (keys, pins, eviction, counters)
    launch.py     plan_instances, VllmInstances: start and supervise the vLLM instances of one host
    backend.py    VllmBackend: the API's backend over the instances (and over nodes)
    node.py       agentshare vllm-node: agents' instances on another host; NodeClient, the frontend's view
    relay.py      push_blocks, StoreReceiver: prefix blocks from one host's store into another's over TCP
    serve.py      the entry points: serve --engine vllm, vllm-node

Only ``connector`` imports vLLM (it is loaded inside vLLM's processes); the rest runs wherever the
server's own dependencies are installed.
"""
