"""The CUDA driver, loaded lazily."""
