"""RL math on experience tensors: KL estimators, reward shaping, advantages, presets."""
