"""Engine-side client library: daemon connection and engine integrations (issues 3, 5)."""
