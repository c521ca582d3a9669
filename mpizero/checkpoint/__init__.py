"""Sharded checkpoints: written per rank, validated before they are trusted."""
