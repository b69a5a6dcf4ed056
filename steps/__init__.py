"""Step functions: `(TrainState, batch) -> (TrainState, metrics)`, one optimizer update each."""
