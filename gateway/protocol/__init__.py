"""The wire formats clients speak: parsing requests, SSE, rendering answers."""
