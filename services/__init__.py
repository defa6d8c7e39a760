"""sked's processes: one subpackage per service, plus the `sked` command line."""
