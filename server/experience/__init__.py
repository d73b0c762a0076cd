"""Experience making: a MakeExperience request in, Experience micro-batches out."""
