// One owner per spool directory, by a protocol the Python SDK speaks too
// (clients/python/src/rtrl_client/spool_lock.py): two senders on one directory would resend each
// other's events, whichever SDK each is. Node has no flock, so the lock is a file: `spool.lock`
// holds its owner as one line of JSON, {"pid", "host", "started"}, written whole under a
// temporary name and hard-linked into place (which fails if a lock exists). A lock is stale, and
// taken over, when its owner is gone: on this host, a pid not running, or running but started at
// another moment (reused), or a lock naming no owner. A lock from another host is never judged.
// A stale lock is moved aside (rename) and looked at again before it is dropped, and put back if
// it is no longer the one judged stale.
import { closeSync, constants, fsyncSync, linkSync, openSync, readFileSync, renameSync, unlinkSync, writeSync } from "node:fs";
import { hostname } from "node:os";
import { join } from "node:path";

const LOCK = "spool.lock";
const NOFOLLOW = constants.O_NOFOLLOW;

/** Another live process uses this spool directory; two senders would resend each other's events. */
export class SpoolLocked extends Error {
  override name = "SpoolLocked";
}

interface Owner {
  pid: number;
  host: string;
  /** `<boot id>/<start tick>` of the process (Linux); empty where that is unknown. */
  started: string;
}

/** When process `pid` started, as `<boot id>/<start tick>` (Linux's /proc); empty where the
 * system does not say. */
function processStarted(pid: number): string {
  try {
    const boot = readFileSync("/proc/sys/kernel/random/boot_id", "utf8").trim();
    const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
    // The command name (field 2) may hold spaces and parentheses: count after its last ")".
    const fields = stat.slice(stat.lastIndexOf(")") + 2).split(/\s+/);
    return fields.length > 19 ? `${boot}/${fields[19]}` : "";
  } catch {
    return "";
  }
}

function ownerLine(owner: Owner): string {
  return `${JSON.stringify({ pid: owner.pid, host: owner.host, started: owner.started })}\n`;
}

/** The owner a lock names, or undefined when it names none. */
function parseOwner(text: string): Owner | undefined {
  try {
    const fields = JSON.parse(text) as Record<string, unknown>;
    const pid = Number(fields.pid);
    if (!Number.isSafeInteger(pid) || pid <= 0 || typeof fields.host !== "string") return undefined;
    if (typeof fields.started !== "string") return undefined;
    return { pid, host: fields.host, started: fields.started };
  } catch {
    return undefined;
  }
}

/** Whether this owner (on this host) no longer runs. */
function gone(owner: Owner): boolean {
  try {
    process.kill(owner.pid, 0);
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code !== "EPERM") return true; // EPERM: another user's
  }
  const now = owner.started ? processStarted(owner.pid) : "";
  return now !== "" && now !== owner.started;
}

function readLock(path: string): string {
  const fd = openSync(path, constants.O_RDONLY | NOFOLLOW);
  try {
    return readFileSync(fd, "utf8").slice(0, 4096);
  } finally {
    closeSync(fd);
  }
}

/** Take `spool.lock`, taking over a stale one; the line it holds. Throws SpoolLocked. */
export function acquireLock(directory: string): string {
  const lock = join(directory, LOCK);
  const me: Owner = { pid: process.pid, host: hostname(), started: processStarted(process.pid) };
  const line = ownerLine(me);
  const temporary = join(directory, `${LOCK}.${process.pid}.${Math.random().toString(36).slice(2)}`);
  const fd = openSync(temporary, constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL | NOFOLLOW, 0o600);
  writeSync(fd, line);
  fsyncSync(fd);
  closeSync(fd);
  try {
    for (let attempt = 0; attempt < 5; attempt++) {
      try {
        linkSync(temporary, lock);
        return line;
      } catch (error) {
        if ((error as NodeJS.ErrnoException).code !== "EEXIST") throw error;
      }
      takeOverIfStale(directory, me);
    }
    throw new SpoolLocked(`spool ${directory}: could not take ${LOCK} (contended)`);
  } finally {
    unlinkSync(temporary);
  }
}

/** Remove the lock in `directory` if its owner is gone; throw SpoolLocked if it is not. */
function takeOverIfStale(directory: string, me: Owner): void {
  const lock = join(directory, LOCK);
  let text: string;
  try {
    text = readLock(lock);
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code === "ENOENT") return; // released meanwhile
    throw error;
  }
  const holder = parseOwner(text);
  if (holder && holder.host !== me.host) {
    throw new SpoolLocked(
      `spool ${directory} is held by process ${holder.pid} on host ${JSON.stringify(holder.host)}; ` +
        `if that process is gone, remove ${lock}`,
    );
  }
  if (holder && !gone(holder)) throw new SpoolLocked(`spool ${directory} is in use by process ${holder.pid}`);
  const aside = join(directory, `${LOCK}.stale.${process.pid}.${Math.random().toString(36).slice(2)}`);
  try {
    renameSync(lock, aside);
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code === "ENOENT") return;
    throw error;
  }
  if (readLock(aside) !== text) {
    // A new owner's lock, taken between our read and our rename: put it back.
    try {
      linkSync(aside, lock);
    } catch {
      // another owner again: it holds the directory
    }
  }
  unlinkSync(aside);
}

export function releaseLock(directory: string, line: string): void {
  const lock = join(directory, LOCK);
  try {
    if (readLock(lock) === line) unlinkSync(lock);
  } catch {
    // already gone
  }
}

