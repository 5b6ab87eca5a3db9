"""Checkpoints and exported weights: DCP saves and loads, their checksums, every rank's agreement on a write, safe reading, the model's own state-dict hooks, safetensors export."""
