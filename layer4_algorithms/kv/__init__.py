"""The KV cache, paged: which block holds which tokens (`BlockManager`: ref counts,
copy-on-write, the hash-chained prefix cache), the tensors (`PagedKVCache`: layer 3's KVCache
protocol over blocks) and the decode kernel that reads K/V through block tables
(`paged_decode_attention`, with its torch reference). `layer4_algorithms.bench.paged_attention`
times the kernel against SDPA (`stack bench --layer 4 --only kernel`)."""
from .block_manager import BlockManager, PrefixCacheStats
from .paged_attention import (
    decode_bytes_and_flops,
    paged_decode_attention,
    paged_decode_attention_reference,
    pick_num_splits,
)
from .paged_cache import PagedKVCache, blocks_for_budget, bytes_per_block, padded_table

__all__ = [
    "BlockManager", "PrefixCacheStats",
    "PagedKVCache", "blocks_for_budget", "bytes_per_block", "padded_table",
    "paged_decode_attention", "paged_decode_attention_reference", "pick_num_splits",
    "decode_bytes_and_flops",
]
