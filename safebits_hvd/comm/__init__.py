"""The communication layer: how payloads travel and ranks agree. The collective paths (:mod:`.collectives`), the
transports that move bytes (:mod:`.transports`), the statistics exchange (:mod:`.exchange`, the vector it carries
in :mod:`.statistics`) and the step clock that times the waits (:mod:`.clock`). It imports only the codec layer
(docs/DESIGN.md, "Module map")."""
