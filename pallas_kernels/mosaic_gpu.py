"""What the Mosaic GPU kernels share: their interpret mode and their synchronous copies."""

from jax.experimental.pallas import mosaic_gpu as plgpu


def interpreter():
    """Mosaic GPU interpret mode; jax 0.10.2 has `InterpretGPUParams` only under `jax._src`, so it
    is imported when asked for, and the kernels themselves do not depend on the private path."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def fetch(barriers, *copies) -> None:
    """Synchronous TMA loads of (source, destination) pairs, copy i signalling barrier i."""
    plgpu.commit_smem()  # earlier register reads of the destinations are done
    for i, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, barriers.at[i])
    for i in range(len(copies)):
        plgpu.barrier_wait(barriers.at[i])


def store(src, dst) -> None:
    """Synchronous TMA store from shared memory."""
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(src, dst)
    plgpu.wait_smem_to_gmem(0)
