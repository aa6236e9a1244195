"""What the tests and the benchmarks share, importable by both without path tricks (installed beside
``milestream`` by the same editable install; no test helper lives inside ``milestream`` itself):

- ``chaos``: the stages and embedded services of a running run, found and killed as a crash would;
- ``fuzz_records``: hostile records, seeded, for every topic a stage reads;
- ``servers``: engine and router servers started as ``milestream`` subprocesses, waited for until they listen.
"""
