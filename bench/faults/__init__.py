"""The reliability campaign's scenarios (``bench/reliability.py`` runs them; the tests in
``tests/reliability/`` run each in its short form)."""
