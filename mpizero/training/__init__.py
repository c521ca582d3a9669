"""Models with hand-written backward, the data they train on, and the layer-wise trainer."""
