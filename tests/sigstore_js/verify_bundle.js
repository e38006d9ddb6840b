// Verify a key-based Sigstore bundle with sigstore-js (@sigstore/verify): the key is looked up by
// the bundle's publicKey.hint, no transparency-log entry or timestamp is required.
// usage: node verify_bundle.js BUNDLE KEY.pub [SUBJECT_SHA256]
const fs = require('fs');
const crypto = require('crypto');
const { bundleFromJSON } = require('@sigstore/bundle');
const { toSignedEntity, toTrustMaterial, Verifier } = require('@sigstore/verify');

const [bundlePath, pubPath, digest] = process.argv.slice(2);
const bundle = bundleFromJSON(JSON.parse(fs.readFileSync(bundlePath, 'utf8')));
const pub = crypto.createPublicKey(fs.readFileSync(pubPath, 'utf8'));
const der = pub.export({ type: 'spki', format: 'der' });
// the hint as model-signing 1.x (and moeaudit) write it: hex SHA-256 of the PEM SPKI
const hint = crypto.createHash('sha256').update(pub.export({ type: 'spki', format: 'pem' })).digest('hex');
const root = { mediaType: 'application/vnd.dev.sigstore.trustedroot+json;version=0.1', tlogs: [],
               certificateAuthorities: [], ctlogs: [], timestampAuthorities: [] };
const trust = toTrustMaterial(root, { [hint]: { rawBytes: der } });
const verifier = new Verifier(trust, { tlogThreshold: 0, ctlogThreshold: 0, timestampThreshold: 0 });
verifier.verify(toSignedEntity(bundle));
const statement = JSON.parse(Buffer.from(bundle.content.dsseEnvelope.payload).toString('utf8'));
if (digest && !statement.subject.some((s) => s.digest.sha256 === digest)) {
  throw new Error(`no subject with sha256 ${digest}`);
}
process.stdout.write(JSON.stringify({ verified: true, predicateType: statement.predicateType,
                                      subjects: statement.subject.length }) + '\n');
