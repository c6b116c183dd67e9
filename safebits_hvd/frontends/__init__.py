"""The front ends, the top layer: Horovod's compressor (:mod:`.horovod`, its elastic state in :mod:`.elastic`),
PyTorch DDP's communication hook (:mod:`.ddp`, the hop across nodes in :mod:`.ddp_nodes`), FSDP2's reduce-scatter
(:mod:`.fsdp`), what they share (:mod:`.shared`, :mod:`.params`), the compressors SafeBits is compared with
(:mod:`.baselines`) and the launcher of the tests and benchmarks (:mod:`.launch`). None imports another front end
(docs/DESIGN.md, "Module map")."""
