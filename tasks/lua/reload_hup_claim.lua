-- One SIGHUP per gunicorn master and models-file revision (app/reloading.py).
-- KEYS: a master's claim. ARGV: the announced revision. 1 (and the claim is this revision's)
-- unless the master was sent a SIGHUP for it already.
if redis.call('get', KEYS[1]) == ARGV[1] then return 0 end
redis.call('set', KEYS[1], ARGV[1], 'EX', 3600)
return 1
