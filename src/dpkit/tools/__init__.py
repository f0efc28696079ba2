"""Tools that run models to measure: `bench` (strategies side by side), `profile` (one strategy, per device),
`doctor` (this machine's devices and links), and the `demo`."""
