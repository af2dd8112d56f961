"""Who may act on a run: the owner's key and signatures (`keys`, `signatures`), the members it
admits (`admissions`), and a stage peer's checks of every call before its payload is read (`gate`)."""
