"""The trainer side of UpdateWeights: the update file, its data planes and weights groups."""
