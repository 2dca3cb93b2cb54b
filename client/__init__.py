"""Engine-side client library (daemon connection, engine integrations); arrives with issues 3 and 5."""
