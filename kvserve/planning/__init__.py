"""Capacity planning and serving cost, from the same sizing code the engine allocates by."""
