"""Console forms of the scheduler (cordon, drain and the fit planner come with Scheduler I)."""
