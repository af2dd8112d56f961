"""The stage peer's side of the hivemind transport: hosting one stage and serving its calls."""
