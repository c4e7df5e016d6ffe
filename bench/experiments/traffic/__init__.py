"""Live traffic first: priorities, deadlines and shares under mixed load."""
