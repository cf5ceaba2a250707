"""A team's own trainer kind, outside Relay: a line fitted to single-digit sums (a + b) by SGD, chunked and resumed
by Relay through the trainer contract. Registered by its distribution's entry point (relay.trainers), never named
in Relay's code."""
