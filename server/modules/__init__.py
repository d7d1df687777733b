"""Decode modules: base, LoRA and full fine-tunes of one base, with their manifests."""
