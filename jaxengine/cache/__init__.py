"""Host-side cache bookkeeping: plain Python, no JAX, so it is fast and easy to property-test."""
