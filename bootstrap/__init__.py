"""hlbp.bootstrap: the long-lived DHT entry point that publishes the run manifest."""
