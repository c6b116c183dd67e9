"""The step layer: the framework-free engine of one step. The core and its state object (:mod:`.core`), the send
with its screen and escalation (:mod:`.sending`), the close (:mod:`.closing`), error feedback (:mod:`.memory`), the
two-phase path's middle hop (:mod:`.two_phase`) and checkpoints (:mod:`.checkpoint`). Front ends drive it; it
never imports them (docs/DESIGN.md, "Module map")."""
