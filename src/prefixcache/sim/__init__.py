"""The simulator: replay traces through the real cache, compare policies, bound them."""
