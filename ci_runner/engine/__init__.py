"""What crosses a process or file boundary: the wire format (codec), a module's tensors handed to a child (handoff),
repro scripts (repro) and the versions a cell ran with (envinfo). Processes are in `procs/`, models in `models/`, hooks
and watches in `watch/`, failures in `failures/`, how a phase or a TP layout runs in `workloads/`."""
