"""Planning a pod run before renting it: what a compiled step moves, and what that costs."""
