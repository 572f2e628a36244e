"""Work a step does only when a runtime flag says so, in the two forms XLA runs well."""

from collections.abc import Callable

import jax
import jax.numpy as jnp


def if_in_place(flag: jax.Array, body: Callable, carry):
    """`body(carry)` if `flag` (a bool scalar), else `carry`: a loop of one iteration or none,
    not a conditional, so the arrays in `carry` are updated in place (XLA copies those a
    branch returns). XLA hoists out of a loop what depends only on values it does not change,
    and runs that whether the loop runs or not: `body` takes its inputs through `carry` and
    returns them changed (spent) to keep its work inside."""
    return jax.lax.fori_loop(0, flag.astype(jnp.int32), lambda _, carry: body(carry), carry)


def when(flag: jax.Array, fn: Callable, *args):
    """`fn(*args)` if `flag`, else zeros shaped as its result (a `lax.cond`: for results that
    are fresh arrays, not updates of the pools)."""
    return jax.lax.cond(flag, fn, lambda *a: jax.tree.map(jnp.zeros_like, jax.eval_shape(fn, *a)), *args)
