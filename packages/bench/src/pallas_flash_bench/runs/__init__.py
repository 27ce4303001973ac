"""A bench run: its jobs run in a pool of compile workers (`workers`, `worker`), cached (`cache`);
the longest fitting sequence (`fit`), wall-clock times on a TPU (`measure`), the whole run
(`runner`) and one kernel's look (`inspection`)."""
