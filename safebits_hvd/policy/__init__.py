"""The policy layer: what each tensor is sent as. The per-step decisions (:mod:`.budget`), the global knapsack
(:mod:`.allocator`), the safety screen (:mod:`.screen`), budget schedules (:mod:`.schedules`) and ``auto``
(:mod:`.auto`, with :mod:`.quality`), and the step records they read (:mod:`.telemetry`). It imports the
communication and codec layers only (docs/DESIGN.md, "Module map")."""
