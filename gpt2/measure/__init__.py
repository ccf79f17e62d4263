"""Not a stage: measuring what each optimization buys (ladder) and what a run will cost (plan)."""
