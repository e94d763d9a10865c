"""The DeepSeek-V4 forward: pure functions over registered-dataclass pytrees (layers, attention with its compressor
and indexer, MoE), the KV cache they read and write (cache.py) and the one logical-axis table (sharding.py)."""
