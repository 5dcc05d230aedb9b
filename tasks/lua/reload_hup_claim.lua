-- One SIGHUP per gunicorn master and announcement (app/reloading.py).
-- KEYS: a master's claim, "<announcement> <revision> <sent at>".
-- ARGV: the announcement's number ('' before any), its revision, when the asking process read
-- its models file, now (that host's clock: the claim is per host and master).
-- 1 (and the claim is this announcement's, sent now) unless the master was sent a SIGHUP for
-- this very announcement after the asking process read its file: a SIGHUP for it sent before
-- replaced the processes that existed then, not the one asking (started by it, it read the
-- file after a rollback), which would otherwise hand over for ever with no SIGHUP to come.
local claim = redis.call('get', KEYS[1])
if claim then
  local number, revision, at = string.match(claim, '^(%S*) (%S+) (%S+)$')
  if number == ARGV[1] and revision == ARGV[2] and tonumber(at) >= tonumber(ARGV[3]) then
    return 0
  end
end
redis.call('set', KEYS[1], ARGV[1] .. ' ' .. ARGV[2] .. ' ' .. ARGV[4], 'EX', 3600)
return 1
