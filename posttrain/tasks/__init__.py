"""Built-in synthetic tasks with exact solutions and step labels (the offline demo world)."""
