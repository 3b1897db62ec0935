"""Run directories: the run dir itself (`run_dir`), its checkpoints (`checkpoint`, `paths`), resuming (`resume`), which
run configs keel obeys (`trust`) and the checks on files a run holds, which may be damaged or hostile (`untrusted`)."""
