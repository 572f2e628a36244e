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
        """`depth -> saved FLOPs per byte held`, the value the eviction rule weighs hits by."""
        return lambda depth: self.prefix_flops(depth) / max(self.hit_bytes(depth), 1)

    def rung_value(self, depth: int) -> float:
        """What a rung of a prompt's ladder (`checkpoint_policy`) at `depth` saves per byte while
        deeper checkpoints hold its pages: the compute between it and the rung below (half as
        deep) per checkpoint byte, the only bytes its eviction frees."""
        return (self.prefix_flops(depth) - self.prefix_flops(depth // 2)) / max(self.checkpoint_bytes, 1)
