"""Hot loops shared by the trainer, weight_sync and inference.

Each kernel has a portable torch path (this package's modules); GPU paths, when
added, live beside it and are tested against it.
"""

from kernels.delta import SparseXorDelta, bits_dtype, delta_apply, delta_encode

__all__ = ["SparseXorDelta", "bits_dtype", "delta_apply", "delta_encode"]
