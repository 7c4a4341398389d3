"""What the server tells about itself: metrics, the /metrics page, log settings, loop load, custom metrics, traces."""
