-- backend_release: free the backend slot a job holds.
-- uses: backends
-- KEYS: (none)
-- ARGV: job
-- returns: the backend released | nil

return release_backend(ARGV[1])
