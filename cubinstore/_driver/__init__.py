"""The CUDA driver, loaded lazily (`cuda`), and the one cache of device facts (`device`)."""
