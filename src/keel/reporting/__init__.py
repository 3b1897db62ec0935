"""What a run will be and what it was: the plan before it runs (`plan`), tables (`tables`), plots (`plot`) and
optional trackers (`tracking`)."""
