"""The codec layer, the lowest: what a tensor can be sent as (:mod:`.actions`), the bytes on the link
(:mod:`.wire`), the counter-based RNG of stochastic rounding (:mod:`.rng`), the kernels that encode and decode
(:mod:`.kernels`, CPU and CUDA) and the host seam every host-device crossing goes through (:mod:`.host`). It imports
no other layer (docs/DESIGN.md, "Module map")."""
