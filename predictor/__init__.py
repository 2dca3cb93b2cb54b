"""Return-time predictor and placement policy (features, model, policy); arrives with issue 4."""
