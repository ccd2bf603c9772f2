"""The states of a host slot (:mod:`~kvferry.cache._directory` says what each means), in
a module of their own: the directory's compiled loops (:mod:`~kvferry.cache._kernels`)
read them as constants."""

FREE, STORING, READY, STORING_DROPPED, READY_DROPPED, DEMOTING = 0, 1, 2, 3, 4, 5
