"""Communication: every collective mpizero makes, watched, counted and agreed."""
