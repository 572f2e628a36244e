"""What a prefix-cache hit is worth: the compute it saves per byte the cache holds for it."""

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    """The numbers of a model the cache's eviction rule needs."""

    num_weights: int  # multiply-accumulates per token, roughly: two FLOPs per weight per token
    attention_width: int  # attention layers x query heads x head dim (quadratic score/value FLOPs)
    kv_bytes_per_token: int  # KV cache bytes one token takes in all attention layers
    checkpoint_bytes: int  # bytes one recurrent-state checkpoint takes in cache blocks (0: none)

    def prefix_flops(self, num_tokens: int) -> float:
        """Forward FLOPs a prefix of `num_tokens` costs: two per weight per token, plus
        attention's quadratic score and value products."""
        return 2.0 * self.num_weights * num_tokens + 2.0 * self.attention_width * num_tokens * num_tokens

    def hit_bytes(self, num_tokens: int) -> int:
        """Bytes a hit of `num_tokens` needs held: its pages and its checkpoint."""
        return self.checkpoint_bytes + num_tokens * self.kv_bytes_per_token

    def value_fn(self) -> Callable[[int], float]:
        """`depth -> saved FLOPs per byte held`, the value the eviction rule weighs a cached
        page by (models without recurrent layers, whose every page is a hit point)."""
        return lambda depth: self.prefix_flops(depth) / max(self.hit_bytes(depth), 1)

    def checkpoint_value(self, depth: int, above: int, frees_pages: bool) -> float:
        """What a checkpoint at `depth` saves per byte its eviction frees, when `above` is the
        depth of the nearest checkpoint above it on its path (0: none), where its hits would
        resume without it: the compute between the two, per byte of the checkpoint and, when
        `frees_pages` (no checkpoint below it holds them), of the pages between the two.

        This is Marconi's FLOP efficiency of a radix node (Pan et al., MLSys 2025) for a
        checkpoint: a checkpoint a page past another saves a page's compute, however deep, so
        a path dense with junctions keeps its pages and a sparse ladder rather than a few whole
        paths of checkpoints."""
        saved = self.prefix_flops(depth) - self.prefix_flops(above)
        freed = self.checkpoint_bytes + ((depth - above) * self.kv_bytes_per_token if frees_pages else 0)
        return saved / max(freed, 1)
