"""A simulated product: users with hidden style preferences asking for small edits."""
